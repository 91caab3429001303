"""Weight hot-swap: fence, update, verify, resume; modes in_place / retract / abort_resume / drain, rolling."""

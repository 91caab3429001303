"""The pure core: data model, stamping rules, staleness. No I/O imports here."""

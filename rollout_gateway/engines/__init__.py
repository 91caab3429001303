"""SGLang engine adapters: response decoding (hot path), HTTP client, engine pool."""

"""The llama-servers: the admin client, what is known of each server, router mode and llama-
swap, models as upstreams, GGUF headers."""

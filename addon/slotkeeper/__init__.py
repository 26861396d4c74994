"""slotkeeper: pin each client session of llama-server to its own KV-cache slot."""

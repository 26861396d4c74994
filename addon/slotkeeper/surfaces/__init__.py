"""Client APIs that llama-server does not pin, translated to the ones it does: Anthropic
Messages and Ollama's /api/*."""

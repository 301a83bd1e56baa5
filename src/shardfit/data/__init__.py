"""Data: read JSON/JSONL in alpaca, ShareGPT or OpenAI-messages format, tokenise with assistant-only labels, pack."""

"""Who may call what: the browser guard (Host and Origin), CORS, and access to slotkeeper's own
endpoints."""

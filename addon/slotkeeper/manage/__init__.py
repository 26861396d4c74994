"""slotkeeper's own endpoints: the session API (/api/sessions, /api/upstreams) and /metrics."""

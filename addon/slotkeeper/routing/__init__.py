"""The router and its rooms: a request's walk from its session to a slot under a lease
(sessions, pool, model swaps, walk, handover), and what follows the answer (accounting,
first turns)."""

"""Which session a request belongs to, and what kind of request it is (conversation, side task,
one-off). Pure."""

"""What is remembered: the state store shared by every proxy process (the JSON state file, the
slot locks) and this process's bounded memories. The etcd backend goes here."""

"""Pure decisions: which slot a session gets, the conversation rules (continue, fork, side,
save or not), and which server of a pool. No I/O, no clock."""

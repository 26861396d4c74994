"""The slotkeeper command: mitm.conf to mitmdump arguments, the local llama-server it starts,
the demo and status."""

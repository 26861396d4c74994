"""Observability: the Prometheus counters, what mitmweb shows of each flow's routing, and
streamed answers kept in their flows."""

"""The wire: what a request and an answer are (bodies, SSE, timings), the seam for surfaces
that translate another API, and slotkeeper's own answers. Pure; the bottom layer."""

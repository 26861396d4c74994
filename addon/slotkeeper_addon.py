"""What `mitmdump -s addon/slotkeeper_addon.py` loads. mitmproxy puts this file's folder on
sys.path while loading it, so the `slotkeeper` package next to it imports from a checkout too."""

from slotkeeper.addon import addons  # noqa: F401  (mitmproxy looks for `addons`)

"""What `mitmdump -s addon/slotkeeper_addon.py` loads. mitmproxy puts this file's folder on
sys.path while loading it, so the `slotkeeper` package next to it imports from a checkout too.
On a script reload this file runs again and gets fresh addon objects; the package's modules
(and with them the metrics registry) stay loaded, so counters survive."""

from slotkeeper.addon import make_addons

addons = make_addons()

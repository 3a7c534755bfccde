"""The worker side: device copies (device.py) and the event-loop pipelines (transfer.py)."""

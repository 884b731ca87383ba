"""Injected faults: named fault points (`FaultPlan`) and chaos mode (the kill monkey)."""

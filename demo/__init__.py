"""``kvbroker demo``: move real KV bytes between brokers and verify every byte.

``orchestrator`` starts the brokers and one process per engine rank
(``engine``). What the ranks move and check comes from ``kvbroker.testing``,
shared with the test scenarios: ``room_plan`` decides which pages each room
uses on each side; ``pattern`` gives every byte of the full model's KV a
value of its own, so the decode side can check what arrived against a
reference it computes itself, independently of the broker's transfer code.
"""

"""Fault injection for the robustness tests: an S3 proxy that misbehaves on a seeded schedule, and
extraction shards run as real processes that can be SIGKILLed at any point."""

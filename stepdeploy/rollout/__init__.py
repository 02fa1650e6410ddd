"""Staged rollout: warmup, scaling ladder and soak, gated, resumable, recorded in the ledger."""

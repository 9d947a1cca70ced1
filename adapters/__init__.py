"""Stateful interfaces rebuilt on the fmp core (adapters.apex comes first)."""

"""Inputs: prompt encoding, emphasis spans, token helpers and images."""

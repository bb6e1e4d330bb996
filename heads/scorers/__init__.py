"""Head scorers that only read the model: span attention, sinks, MAPS, safety heads (Ships, attribution)."""

"""What `headsteer explore` and `headsteer serve` share over HTTP: request bodies read within a
byte limit and checked by pydantic request models (`viz.web.body`), and the cross-site guard
(`viz.web.guard`: the `Host` check on loopback binds, JSON-only bodies, an optional API key)."""

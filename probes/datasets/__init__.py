"""Data sets shipped with headsteer (tasks, requests, relation pairs) and their loaders."""

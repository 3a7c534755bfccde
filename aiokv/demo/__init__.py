"""The demo and the tiny models it (and the tests) build locally, without a hub."""

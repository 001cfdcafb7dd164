"""The top of the house: what starts and composes the services (the `stepwire` command, the local stack,
the in-process engine). It may import every service; no service, and nothing in `stepwire`, imports it."""

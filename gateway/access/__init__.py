"""Who may call and how much: API keys, tenants, the files they come from, body and connection limits.
Imports nothing else of the gateway.
"""

"""What every service needs to be safe on a network: mTLS credentials that follow rotated files, the rule
that an unprotected port stays on loopback, and decode errors answered as the caller's fault."""

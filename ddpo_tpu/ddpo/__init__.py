"""DDPO algorithm pieces (advantages / per-prompt stat tracking, ...)."""

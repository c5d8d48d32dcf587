"""Scheduling: the bounded queue, fairness across tenants, and the running generations it feeds."""

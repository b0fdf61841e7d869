"""The planner: scales expert pools and decode replicas from their load (``k3 serve planner``)."""

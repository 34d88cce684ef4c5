"""Guest stage: SSH transport, facts, playbooks and templates."""

"""Low-level helpers every part uses: collectives, logging to every logger, input checks and their wording."""

"""Real models and checkpoint loading: ``catalog`` finds and loads the installed real models."""

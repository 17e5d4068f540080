"""``mars serve``: an OpenAI-compatible HTTP service over the MARS decoder (see README, "Serving")."""

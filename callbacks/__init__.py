"""Read-only training monitors, installed as ``amir_lightning.callbacks``; training is identical without them."""

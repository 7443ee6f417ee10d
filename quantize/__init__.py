"""quantize: recipe → calibrate → quantize → export → eval → gate, checked and resumable."""

__version__ = "0.1.0"

"""Pure pandas analyses over run-store frames: TTFT partition, token accounting, comparison."""

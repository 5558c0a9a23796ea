"""The run side: the decoding engine (engine/), serving (serving/) and control (control/)."""

"""Examples of bringing your own model, loss and data to ray_resume."""

"""Generated gRPC modules (``make proto`` from proto/tensorwire/v1); do not edit."""

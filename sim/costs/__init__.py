"""Pure cost functions: the time of a collective and of the computation, from a profile."""

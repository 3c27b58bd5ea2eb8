"""The project's runtimes: how the three stages run (processes, threads, serial) and
the pieces they share."""

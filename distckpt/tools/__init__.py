"""Tools on top of the manager: the command line, the doctor, weights in and out, importers and
inspection."""

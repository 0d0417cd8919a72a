"""The one kind of error a user fixes: bad input, named.

Every error class for input a user gives (a config or override, a task file, a PDF folder, a
checkpoint, a tokenizer, a GGUF file, a backend or extra that is not installed) derives from
`UserError`. The command line (`rlmtrain.cli`) catches it once, for every command, and prints it
as one line naming the input, exit 2, never a traceback; anything else is a bug and keeps its
traceback. The classes keep their older bases too (ValueError, RuntimeError), so library callers
that catch those still do.
"""


class UserError(Exception):
    """Input the user can fix; the message is one line naming it."""

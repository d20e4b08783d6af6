"""Property-based fuzzing of every reader of other tools' files (and of run.json): each either
returns a result or raises `InputError` naming the file, never any other exception."""

// Client-supplied text in the daemon's log and in status output.
//
// Note [Client strings in the log]: job names, group keys, region labels,
// parameter names, base paths and keys come from clients. Written to the log
// raw, a newline forges a whole log line ("... job='x\n<date> info ... session 7
// ended") and an ANSI escape rewrites the terminal of whoever reads it. Every
// log call that prints such a string (or an error message that may quote one)
// passes it through LogSafe(). Job names, group keys, region labels, parameter
// names and weight checksums are also refused (INVALID_ARGUMENT, by
// ControlService) unless they are PrintableUtf8(): they reach `trainstreamctl
// status` output and error messages that other code logs.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace trainstream::daemon {

// `text` with every byte that could change how a log line reads escaped as
// \xNN: C0 controls (including \n, \r, \t, ESC), DEL, the UTF-8 encodings of C1
// controls (U+0080..U+009F, which some terminals take as CSI), every byte of an
// invalid UTF-8 sequence, and the backslash itself (so an escape cannot be
// faked). Longer than `max_bytes` of input: cut there, with "...(+N bytes)".
std::string LogSafe(std::string_view text, size_t max_bytes = 256);

// True when `text` is valid UTF-8 with no control character (C0, DEL, C1): what
// LogSafe would leave unchanged, apart from backslashes and length.
bool PrintableUtf8(std::string_view text);

}  // namespace trainstream::daemon

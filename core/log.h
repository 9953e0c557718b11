#pragma once
// The one log format of every Sparrow program (docs/cli.md), applied by the
// logger itself so that no call site can break it:
//
//   text: 2026-11-25T08:40:12.345 level=info event=round_completed round=3 seconds=0.412
//   json: {"ts":"2026-11-25T08:40:12.345+01:00","level":"info","event":"round_completed","round":3,...}
//
// A call site writes the body: "event=NAME key=value ... msg=\"...\"" (values
// with spaces quoted, quotes and backslashes in them escaped as \" and \\).
// A body that does not start with "event=" is free text: it becomes
// `event=message msg="..."`, escaped, on one line. In JSON each key=value is a
// field (numbers and true/false as JSON values, everything else a string; a
// quoted value always a string); words that are not key=value go into `msg`
// (or `text` when the line has a msg). `ts`, `level` and `event` are the
// logger's: a body's own key of that name gets a trailing '_'.
//
// Contract: one line per event whatever the body holds (a newline in free
// text is escaped); the text format writes an event body exactly as given.
// Thread safety: spdlog's; the formatter holds no state.

#include <string>
#include <string_view>

namespace sparrow::core {

enum class LogFormat { kText, kJson };

// "text" or "json" (what --log-format accepts); anything else is a ConfigError.
LogFormat parse_log_format(const std::string& name);

// One line (with its '\n') for a body logged at `level` (spdlog's names:
// "info", "warning", ...). `ts` is the local time with milliseconds,
// `offset` the zone ("+01:00"), which only JSON carries.
std::string format_log_line(std::string_view ts, std::string_view offset, std::string_view level, std::string_view body,
                            LogFormat format);

// The body of a free-text line: `event=message msg="..."`.
std::string free_text_body(std::string_view text);

// Installs the format on spdlog: every logger, now and later.
void install_log_format(LogFormat format);

}  // namespace sparrow::core

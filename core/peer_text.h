#pragma once
// Text that came from a peer (client ids, `software`, Error and Bye reasons,
// metric names, device ids) made inert before it reaches a log line, a
// terminal, the dashboard or a report (docs/security.md, "Peer text").
//
// printable() is the one escape every such place uses: its output is plain
// ASCII, one line, with no byte that a terminal, a log parser or an HTML page
// acts on. Bytes 0x20..0x7e pass through except `"` and `\`, which become
// `\"` and `\\`; every other byte (control bytes, DEL, each byte of a
// multi-byte UTF-8 character) becomes `\xNN` (two lowercase hex digits). The
// escape is unambiguous: the original bytes can be read back.
//
// Client ids are also restricted at Hello (valid_client_id): 1 to 64
// characters from A-Z a-z 0-9 and . _ : @ -, so an id never needs escaping
// in a running server; it is escaped anyway where it is shown, because a
// database written before the restriction may hold others.

#include <cstddef>
#include <string>
#include <string_view>

namespace sparrow::core {

std::string printable(std::string_view s);

constexpr size_t kMaxClientIdChars = 64;
// The rule, as users read it in messages and docs.
constexpr const char* kClientIdRule = "1 to 64 characters from A-Z a-z 0-9 . _ : @ -";

bool valid_client_id(std::string_view id);
// "" when `id` is valid; otherwise what is wrong, the id shown printable().
std::string client_id_problem(std::string_view id);

}  // namespace sparrow::core

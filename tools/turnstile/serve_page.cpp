// SPDX-License-Identifier: Apache-2.0
// `turnstile serve`'s page and /state.json: the state rendered on the server, so that the page
// shows it on first load without JavaScript; a small inline script then follows the live
// stream (/events), which sends the same fragment again whenever the state changes.
#include <cstdio>

#include <nlohmann/json.hpp>

#include "common.hpp"
#include "serve.hpp"

namespace turnstile::cli {
namespace {

constexpr int kStateJsonSchemaVersion = 1;

bool known(std::chrono::system_clock::time_point since) { return since.time_since_epoch().count() != 0; }

// Text a peer wrote (names, labels, hosts) as HTML: control characters and bytes that are not
// UTF-8 spelled out as inspect spells them, then the HTML metacharacters escaped.
std::string shown(std::string_view text) { return html_escape(printable(text)); }

std::string process_cell(const EntryInfo& e) {
  if (!e.foreign.empty()) return "foreign: " + shown(e.foreign);
  if (e.pid == 0) return shown(e.host);
  return std::to_string(e.pid) + "@" + shown(e.host);
}

// The age cell: its text as of the look, and the seconds the script counts on from.
std::string age_cell(const EntryInfo& e, std::chrono::system_clock::time_point now) {
  if (!e.foreign.empty() || !known(e.since)) return "<td class=\"age\">-</td>";
  const double seconds = seconds_since(e.since, now);
  char value[32];
  std::snprintf(value, sizeof value, "%.1f", seconds);
  return "<td class=\"age\" data-seconds=\"" + std::string(value) + "\">" + age_text(seconds) + "</td>";
}

std::string entry_row(const char* role, const EntryInfo& e, std::size_t position,
                      std::chrono::system_clock::time_point now) {
  std::string row = "<tr class=\"" + std::string(role) + "\">";
  if (std::string_view(role) == "waiter") row += "<td>" + std::to_string(position) + "</td>";
  row += "<td class=\"token\">" + std::to_string(e.fencing_token) + "</td><td>" + shown(e.kind) + "</td><td>" +
         std::to_string(e.permits) + "</td><td class=\"process\">" + process_cell(e) + "</td><td class=\"label\">" +
         (e.label.empty() ? std::string("-") : shown(e.label)) + "</td>" + age_cell(e, now) + "</tr>\n";
  return row;
}

std::string entries_table(const char* role, const std::vector<EntryInfo>& entries,
                          std::chrono::system_clock::time_point now) {
  const bool waiters = std::string_view(role) == "waiter";
  std::string out = waiters ? "<table class=\"waiters\"><caption>Waiters, in queue order</caption>\n<tr><th>#</th>"
                            : "<table class=\"holders\"><caption>Holders</caption>\n<tr>";
  out += std::string("<th>Token</th><th>Kind</th><th>Permits</th><th>Process</th><th>Label</th><th>") +
         (waiters ? "Waiting for" : "Held for") + "</th></tr>\n";
  if (entries.empty()) out += "<tr class=\"none\"><td colspan=\"7\">none</td></tr>\n";
  for (std::size_t i = 0; i < entries.size(); ++i) out += entry_row(role, entries[i], i + 1, now);
  return out + "</table>\n";
}

std::string mode_text(const Inspection& q) {
  if (q.mode == "semaphore") return "semaphore, limit " + std::to_string(q.limit);
  return shown(q.mode);
}

std::string names_table(const ServedState& state) {
  std::string out =
      "<table id=\"names\"><caption>Names in use</caption>\n"
      "<tr><th>Name</th><th>Mode</th><th>Holders</th><th>Waiters</th></tr>\n";
  if (state.queues.empty()) out += "<tr class=\"none\"><td colspan=\"4\">no name in use</td></tr>\n";
  for (const auto& q : state.queues) {
    out += "<tr class=\"name\"><td class=\"name\">" + shown(q.name) + "</td><td>" + mode_text(q) + "</td><td>" +
           std::to_string(q.holders.size()) + "</td><td>" + std::to_string(q.waiters.size()) + "</td></tr>\n";
  }
  return out + "</table>\n";
}

nlohmann::ordered_json entries_json(const std::vector<EntryInfo>& entries, std::chrono::system_clock::time_point now) {
  auto out = nlohmann::ordered_json::array();
  for (const auto& e : entries) {
    const bool foreign = !e.foreign.empty();
    const bool dated = !foreign && known(e.since);
    out.push_back(
        {{"fencing_token", e.fencing_token},
         {"kind", e.kind},
         {"permits", e.permits},
         {"pid", foreign || e.pid == 0 ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(e.pid)},
         {"host", foreign ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(e.host)},
         {"since", dated ? nlohmann::ordered_json(iso8601(e.since)) : nlohmann::ordered_json(nullptr)},
         {"seconds", dated ? nlohmann::ordered_json(seconds_since(e.since, now)) : nlohmann::ordered_json(nullptr)},
         {"label", e.label.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(e.label)},
         {"foreign", foreign ? nlohmann::ordered_json(e.foreign) : nlohmann::ordered_json(nullptr)}});
  }
  return out;
}

// The page's own style and script: inline, so that it needs nothing but this server (no CDN).
constexpr const char* kStyle = R"(
body{font:15px/1.4 system-ui,sans-serif;margin:1.5em;color:#1b1f24;background:#fff}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.2em 0 .3em}h2 small{color:#57606a;font-weight:normal}
code{font:13px ui-monospace,monospace;background:#f3f4f6;padding:0 .3em}
table{border-collapse:collapse;margin:.4em 0 .8em}caption{text-align:left;font-weight:600;padding:.2em 0}
th,td{border:1px solid #d0d7de;padding:.2em .6em;text-align:left}th{background:#f6f8fa}
td.token,td.age{font-variant-numeric:tabular-nums;text-align:right}
tr.waiter td{background:#fff8e6}tr.holder td{background:#eefbf0}tr.none td{color:#57606a}
.error{color:#a40e26;font-weight:600}.meta,#live{color:#57606a})";

// Follows /events: each message is the fragment of the state, which replaces the old one. The
// ages count on between messages. `?updates=N` stops following after N messages, so that a
// headless browser that waits for the network to go quiet (chromium --virtual-time-budget)
// takes its picture of the page.
constexpr const char* kScript = R"(
(function(){
var state=document.getElementById('state'),live=document.getElementById('live');
var limit=parseInt(new URLSearchParams(location.search).get('updates')||'0',10),count=0,at=performance.now();
function age(s){s=Math.floor(s);if(s<60)return s+' s';var m=Math.floor(s/60);
if(m<60)return m+' min '+String(s%60).padStart(2,'0')+' s';var h=Math.floor(m/60);
if(h<24)return h+' h '+String(m%60).padStart(2,'0')+' min';return Math.floor(h/24)+' d '+String(h%24).padStart(2,'0')+' h';}
setInterval(function(){var d=(performance.now()-at)/1000;
document.querySelectorAll('td[data-seconds]').forEach(function(c){c.textContent=age(parseFloat(c.dataset.seconds)+d);});},1000);
if(!window.EventSource){live.textContent='not live: this browser has no EventSource';return;}
var events=new EventSource('events');
events.onopen=function(){live.textContent='live';};
events.onerror=function(){live.textContent='reconnecting';};
events.onmessage=function(e){state.innerHTML=e.data;at=performance.now();count++;
if(limit>0&&count>=limit){events.close();live.textContent='stopped after '+count+(count==1?' update':' updates');}};
})();)";

}  // namespace

double seconds_since(std::chrono::system_clock::time_point since, std::chrono::system_clock::time_point now) {
  if (!known(since) || now <= since) return 0;
  return std::chrono::duration<double>(now - since).count();
}

std::string age_text(double seconds) {
  const auto s = static_cast<long long>(seconds);
  char text[48];
  if (s < 60) {
    std::snprintf(text, sizeof text, "%lld s", s);
  } else if (s < 3600) {
    std::snprintf(text, sizeof text, "%lld min %02lld s", s / 60, s % 60);
  } else if (s < 86400) {
    std::snprintf(text, sizeof text, "%lld h %02lld min", s / 3600, s / 60 % 60);
  } else {
    std::snprintf(text, sizeof text, "%lld d %02lld h", s / 86400, s / 3600 % 24);
  }
  return text;
}

std::string render_page(const ServedState& state) {
  const auto backend = shown(state.backend);
  std::string out = "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n<title>turnstile: " + backend +
                    "</title>\n<style>" + kStyle + "</style></head>\n<body>\n<h1>turnstile</h1>\n" +
                    "<p>Backend <code id=\"backend\">" + backend + "</code>";
  if (!state.prefix.empty()) out += ", names starting with <code>" + shown(state.prefix) + "</code>";
  out += ". <span id=\"live\">as loaded</span></p>\n<main id=\"state\">\n" + render_state_fragment(state) +
         "</main>\n<script>" + kScript + "</script>\n</body></html>\n";
  return out;
}

std::string html_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string render_state_fragment(const ServedState& state) {
  std::string out =
      "<p class=\"meta\">Looked at <time>" + iso8601(state.taken) + "</time>: " + std::to_string(state.queues.size()) +
      (state.queues.size() == 1 ? " name in use" : " names in use") +
      (state.truncated ? " (more are in use than looked at: narrow with a prefix or raise --max-names)" : "") +
      ".</p>\n";
  if (!state.error.empty()) out += "<p class=\"error\">The last look failed: " + shown(state.error) + "</p>\n";
  out += names_table(state);
  for (const auto& q : state.queues) {
    out += "<section class=\"queue\"><h2>" + shown(q.name) + " <small>" + mode_text(q) + "</small></h2>\n";
    out += entries_table("holder", q.holders, state.taken);
    out += entries_table("waiter", q.waiters, state.taken);
    out += "</section>\n";
  }
  return out;
}

std::string render_state_json(const ServedState& state, std::size_t live_pages) {
  auto names = nlohmann::ordered_json::array();
  for (const auto& q : state.queues) {
    names.push_back(
        {{"name", q.name},
         {"mode", q.mode},
         {"limit", q.mode == "semaphore" ? nlohmann::ordered_json(q.limit) : nlohmann::ordered_json(nullptr)},
         {"holders", entries_json(q.holders, state.taken)},
         {"waiters", entries_json(q.waiters, state.taken)}});
  }
  nlohmann::ordered_json out = {
      {"schema_version", kStateJsonSchemaVersion},
      {"backend", state.backend},
      {"prefix", state.prefix},
      {"time", state.polls > 0 ? nlohmann::ordered_json(iso8601(state.taken)) : nlohmann::ordered_json(nullptr)},
      {"error", state.error.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(state.error)},
      {"polls", state.polls},
      {"failed_polls", state.failed_polls},
      {"live_pages", live_pages},
      {"truncated", state.truncated},
      {"names", names}};
  // A peer may write bytes that are not UTF-8: U+FFFD instead of an exception.
  return out.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

}  // namespace turnstile::cli

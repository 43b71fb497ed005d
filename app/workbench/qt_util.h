#pragma once
// The few conversions every view needs between Qt and the core: file paths (in the file system's
// encoding, not UTF-8 by assumption), the core's wording of durations and byte counts, and the
// JSON-lines events of the `hydrahead` children the views run.
#include <QByteArray>
#include <QFile>
#include <QJsonDocument>
#include <QJsonObject>
#include <QProcess>
#include <QString>
#include <QStringList>
#include <csignal>
#include <filesystem>

#include <torch/cuda.h>

#include "core/util/strings.h"

namespace hh::workbench {

inline std::filesystem::path toPath(const QString& s) { return std::filesystem::path(QFile::encodeName(s).toStdString()); }
inline QString fromPath(const std::filesystem::path& p) { return QFile::decodeName(p.string().c_str()); }
// "12.3s", "4m05s", "2h07m"; "-" for a negative or unknown duration.
inline QString formatSeconds(double s) { return s >= 0 ? QString::fromStdString(util::format_seconds(s)) : QStringLiteral("-"); }
inline QString humanBytes(double b) { return QString::fromStdString(util::human_bytes(b)); }
// The devices a view offers: cpu, and cuda only where this build and machine have it (a job or analysis on a
// cuda the machine lacks would fail at its first tensor).
inline QStringList deviceChoices() {
  QStringList d{QStringLiteral("cpu")};
  if (torch::cuda::is_available()) d << QStringLiteral("cuda");
  return d;
}

// Sends SIGINT to a child process; false when there is none to send it to. One still starting gets it
// when it leaves that state, if it then runs (at most once however often this is called before; nothing
// is left connected for a later start of the same QProcess), so the caller is not held up while it
// starts. Never kill(0): that would reach this process's own group.
inline bool interruptChild(QProcess& child) {
  auto send = [](QProcess& c) {
    const qint64 pid = c.processId();
    return c.state() == QProcess::Running && pid > 0 && ::kill(static_cast<pid_t>(pid), SIGINT) == 0;
  };
  if (child.state() == QProcess::Starting) {
    static constexpr char kPending[] = "hh_interrupt_pending";
    if (!child.property(kPending).toBool()) {
      child.setProperty(kPending, true);
      QObject::connect(
          &child, &QProcess::stateChanged, &child,
          [&child, send](QProcess::ProcessState) {
            child.setProperty(kPending, false);
            send(child);
          },
          Qt::SingleShotConnection);
    }
    return true;
  }
  return send(child);
}

// Takes the complete lines off `pending` (a child's output so far; a partial last line stays), trimmed,
// empty ones skipped: a JSON object with an "event" goes to on_event, any other line to on_text.
template <class OnEvent, class OnText>
void takeEventLines(QByteArray& pending, OnEvent&& on_event, OnText&& on_text) {
  int nl;
  while ((nl = pending.indexOf('\n')) >= 0) {
    const QByteArray line = pending.left(nl).trimmed();
    pending.remove(0, nl + 1);
    if (line.isEmpty()) continue;
    QJsonParseError err;
    const QJsonDocument doc = QJsonDocument::fromJson(line, &err);
    if (err.error == QJsonParseError::NoError && doc.isObject() && doc.object().contains(QStringLiteral("event")))
      on_event(doc.object());
    else
      on_text(QString::fromLocal8Bit(line));
  }
}

}  // namespace hh::workbench

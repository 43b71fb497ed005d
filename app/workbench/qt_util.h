#pragma once
// The few conversions every view needs between Qt and the core: file paths (in the file system's
// encoding, not UTF-8 by assumption) and the core's wording of durations and byte counts.
#include <QFile>
#include <QString>
#include <filesystem>

#include "core/util/strings.h"

namespace hh::workbench {

inline std::filesystem::path toPath(const QString& s) { return std::filesystem::path(QFile::encodeName(s).toStdString()); }
inline QString fromPath(const std::filesystem::path& p) { return QFile::decodeName(p.string().c_str()); }
// "12.3s", "4m05s", "2h07m"; "-" for a negative or unknown duration.
inline QString formatSeconds(double s) { return s >= 0 ? QString::fromStdString(util::format_seconds(s)) : QStringLiteral("-"); }
inline QString humanBytes(double b) { return QString::fromStdString(util::human_bytes(b)); }

}  // namespace hh::workbench

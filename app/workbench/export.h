#pragma once
// Exporting what the views show: any plot as PNG, SVG or PDF (by the file's suffix) and any table as
// CSV, from the plot's or table's context menu or from code. Files are written whole or not at all.
#include <QString>

class QCustomPlot;
class QTableWidget;

namespace hh::workbench {

// Writes the plot at its current size; false with *error naming the file.
bool exportPlot(QCustomPlot* plot, const QString& file, QString* error = nullptr);
// RFC 4180 CSV: the header row, then every row; cells with a comma, quote or newline are quoted.
bool exportTableCsv(const QTableWidget* table, const QString& file, QString* error = nullptr);
// Adds "Export as PNG, SVG or PDF…" / "Export as CSV…" to the widget's context menu.
void addExportMenu(QCustomPlot* plot);
void addExportMenu(QTableWidget* table);

}  // namespace hh::workbench

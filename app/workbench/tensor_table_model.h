#pragma once
// The stored tensors of a checkpoint (name, dtype, shape, element count), read from the safetensors
// headers. Rows keep the summary's natural name order; SortRole lets a proxy sort any column by
// value rather than by display text.
#include <QAbstractTableModel>
#include <vector>

#include "model_summary.h"

namespace hh::workbench {

class TensorTableModel : public QAbstractTableModel {
  Q_OBJECT

 public:
  enum Column { NameColumn, DTypeColumn, ShapeColumn, ElementsColumn, ColumnCount };
  enum Role { SortRole = Qt::UserRole + 1 };

  explicit TensorTableModel(QObject* parent = nullptr);

  void setTensors(std::vector<TensorEntry> tensors);
  void clear() { setTensors({}); }
  const TensorEntry& tensor(int row) const { return tensors_.at(static_cast<std::size_t>(row)); }

  int rowCount(const QModelIndex& parent = {}) const override;
  int columnCount(const QModelIndex& parent = {}) const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  QVariant headerData(int section, Qt::Orientation orientation, int role = Qt::DisplayRole) const override;

 private:
  std::vector<TensorEntry> tensors_;
};

}  // namespace hh::workbench

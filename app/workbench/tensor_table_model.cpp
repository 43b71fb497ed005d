#include "tensor_table_model.h"

namespace hh::workbench {

TensorTableModel::TensorTableModel(QObject* parent) : QAbstractTableModel(parent) {}

void TensorTableModel::setTensors(std::vector<TensorEntry> tensors) {
  beginResetModel();
  tensors_ = std::move(tensors);
  endResetModel();
}

int TensorTableModel::rowCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : static_cast<int>(tensors_.size());
}

int TensorTableModel::columnCount(const QModelIndex& parent) const { return parent.isValid() ? 0 : ColumnCount; }

QVariant TensorTableModel::data(const QModelIndex& index, int role) const {
  if (!checkIndex(index, CheckIndexOption::IndexIsValid | CheckIndexOption::ParentIsInvalid)) return {};
  const TensorEntry& t = tensor(index.row());
  if (role == Qt::DisplayRole || role == Qt::ToolTipRole) {
    switch (index.column()) {
      case NameColumn: return QString::fromStdString(t.name);
      case DTypeColumn: return QString::fromStdString(t.dtype);
      case ShapeColumn: return QString::fromStdString(format_shape(t.shape));
      case ElementsColumn: return QString::fromStdString(group_digits(t.numel));
      default: return {};
    }
  }
  if (role == SortRole) {
    switch (index.column()) {
      case NameColumn: return index.row();  // rows are already in natural name order
      case DTypeColumn: return QString::fromStdString(t.dtype);
      case ShapeColumn:  // by size: the shape's element count
      case ElementsColumn: return static_cast<qlonglong>(t.numel);
      default: return {};
    }
  }
  if (role == Qt::TextAlignmentRole && index.column() == ElementsColumn)
    return int(Qt::AlignRight | Qt::AlignVCenter);
  return {};
}

QVariant TensorTableModel::headerData(int section, Qt::Orientation orientation, int role) const {
  if (orientation != Qt::Horizontal || role != Qt::DisplayRole) return {};
  switch (section) {
    case NameColumn: return tr("Name");
    case DTypeColumn: return tr("DType");
    case ShapeColumn: return tr("Shape");
    case ElementsColumn: return tr("Elements");
    default: return {};
  }
}

}  // namespace hh::workbench
